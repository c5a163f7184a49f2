"""Pure rank-list builders. No process group is needed, so every layout is testable at any world size.

Layout convention (as vLLM/Megatron/NxD): rank = dp_index * tp_size + tp_position, i.e. TP innermost and
contiguous. A trn2 64-rank override table (vllm-neuron's ``_TRN2_MESH``) is kept as data.
"""

from __future__ import annotations

RankLists = list[list[int]]


def _positive(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _dp_size(world_size: int, tp_size: int) -> int:
    _positive("world_size", world_size)
    _positive("tp_size", tp_size)
    if world_size % tp_size:
        raise ValueError(f"tp_size={tp_size} must divide world_size={world_size}")
    return world_size // tp_size


def build_tp_group_ranks(world_size: int, tp_size: int) -> RankLists:
    """Contiguous TP groups: [0..tp-1], [tp..2tp-1], ..."""
    dp = _dp_size(world_size, tp_size)
    return [list(range(d * tp_size, (d + 1) * tp_size)) for d in range(dp)]


def build_dp_group_ranks(world_size: int, tp_size: int) -> RankLists:
    """Full DP columns: the same TP position in every DP replica (equals the DP column group at dp_size=dp)."""
    return build_dp_column_group_ranks(world_size, tp_size, _dp_size(world_size, tp_size))


def _check_component(world_size: int, tp_size: int, dp_component_size: int, name: str) -> int:
    dp = _dp_size(world_size, tp_size)
    _positive(name, dp_component_size)
    if dp % dp_component_size:
        raise ValueError(f"{name}={dp_component_size} must divide dp_size={dp} (world_size={world_size}, "
                         f"tp_size={tp_size})")
    return dp // dp_component_size


def build_component_tp_group_ranks(world_size: int, tp_size: int, dp_component_size: int) -> RankLists:
    """Rectangular TP×component_dp supergroups, DP-major then TP-minor.

    That order makes "all-gather over the supergroup" equal "TP all-gather, then DP all-gather", so a vocab
    sharded over the supergroup comes back contiguous. At dp_component_size=1 this is the TP group.
    """
    num_supergroups = _check_component(world_size, tp_size, dp_component_size, "dp_component_size")
    groups = []
    for sg in range(num_supergroups):
        dp_start = sg * dp_component_size
        groups.append([(dp_start + d) * tp_size + t for d in range(dp_component_size) for t in range(tp_size)])
    return groups


def build_dp_column_group_ranks(world_size: int, tp_size: int, dp_component_size: int) -> RankLists:
    """DP column groups: one TP position across dp_component_size consecutive DP replicas.

    Ordered supergroup-major, then TP position. At dp_component_size=1 each rank is its own size-1 group.
    """
    num_supergroups = _check_component(world_size, tp_size, dp_component_size, "dp_component_size")
    groups = []
    for sg in range(num_supergroups):
        dp_start = sg * dp_component_size
        for t in range(tp_size):
            groups.append([(dp_start + d) * tp_size + t for d in range(dp_component_size)])
    return groups


# The vision seed names this helper explicitly; keep the name as an alias.
_build_dp_column_group_ranks = build_dp_column_group_ranks


def build_vision_tp_group_ranks(world_size: int, vision_tp_size: int) -> RankLists:
    """Vision TP groups: contiguous blocks of vision_tp_size ranks."""
    return build_tp_group_ranks(world_size, vision_tp_size)


def build_vision_dp_group_ranks(world_size: int, vision_tp_size: int, vision_dp_size: int) -> RankLists:
    """Vision DP columns: ranks at the same vision-TP position across vision_dp_size replicas."""
    return build_dp_column_group_ranks(world_size, vision_tp_size, vision_dp_size)


# ---------------------------------------------------------------------------------------------------------
# trn2.48xlarge: 64 logical cores (LNC=2) in an 8×8 layout that is *not* rank-contiguous. Contiguous
# blocks are not always ring-friendly on this topology; vllm-neuron uses this table for row_size 8.
# ---------------------------------------------------------------------------------------------------------
TRN2_MESH: tuple[tuple[int, ...], ...] = (
    (0, 1, 2, 3, 12, 13, 14, 15),
    (4, 5, 6, 7, 8, 9, 10, 11),
    (16, 17, 18, 19, 28, 29, 30, 31),
    (20, 21, 22, 23, 24, 25, 26, 27),
    (32, 33, 34, 35, 44, 45, 46, 47),
    (36, 37, 38, 39, 40, 41, 42, 43),
    (48, 49, 50, 51, 60, 61, 62, 63),
    (52, 53, 54, 55, 56, 57, 58, 59),
)
TRN2_MESH_WORLD_SIZE = 64
TRN2_MESH_ROW_SIZE = 8


def _invert_mesh(mesh: tuple[tuple[int, ...], ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    row_of, col_of = [0] * TRN2_MESH_WORLD_SIZE, [0] * TRN2_MESH_WORLD_SIZE
    for i, row in enumerate(mesh):
        for c, r in enumerate(row):
            row_of[r], col_of[r] = i, c
    return tuple(row_of), tuple(col_of)


TRN2_RANK_TO_ROW, TRN2_RANK_TO_COL = _invert_mesh(TRN2_MESH)


def uses_trn2_mesh(world_size: int, row_size: int, trn2: bool) -> bool:
    """The non-contiguous table applies only to trn2 at world 64 with rows of 8."""
    return trn2 and world_size == TRN2_MESH_WORLD_SIZE and row_size == TRN2_MESH_ROW_SIZE


def rank_to_row(rank: int, row_size: int, world_size: int, trn2: bool = False) -> int:
    if uses_trn2_mesh(world_size, row_size, trn2):
        return TRN2_RANK_TO_ROW[rank]
    return rank // row_size


def rank_to_col(rank: int, row_size: int, world_size: int, trn2: bool = False) -> int:
    if uses_trn2_mesh(world_size, row_size, trn2):
        return TRN2_RANK_TO_COL[rank]
    return rank % row_size


def build_2d_mesh(ranks: list[int], row_size: int, num_rows: int, trn2: bool = False) -> tuple[RankLists, RankLists]:
    """(row_groups, col_groups) of ranks laid out as num_rows × row_size; trn2 at 64×8 uses TRN2_MESH."""
    _positive("row_size", row_size)
    _positive("num_rows", num_rows)
    if len(ranks) != row_size * num_rows:
        raise ValueError(f"len(ranks)={len(ranks)} != row_size * num_rows = {row_size} * {num_rows}")
    if uses_trn2_mesh(len(ranks), row_size, trn2):
        if sorted(ranks) != list(range(TRN2_MESH_WORLD_SIZE)):
            raise ValueError("the trn2 mesh covers ranks 0..63 exactly")
        mesh = [list(row) for row in TRN2_MESH]
    else:
        mesh = [list(ranks[i * row_size:(i + 1) * row_size]) for i in range(num_rows)]
    cols = [[mesh[r][c] for r in range(num_rows)] for c in range(row_size)]
    return mesh, cols


def build_ep_group_ranks(world_size: int, ep_degree: int, trn2: bool = False) -> tuple[RankLists, RankLists]:
    """(EP-TP row groups, EP column groups): world split into ep_degree rows of world/ep ranks."""
    _positive("ep_degree", ep_degree)
    if world_size % ep_degree:
        raise ValueError(f"ep_degree={ep_degree} must divide world_size={world_size}")
    return build_2d_mesh(list(range(world_size)), world_size // ep_degree, ep_degree, trn2=trn2)


def group_containing(groups: RankLists, rank: int) -> list[int]:
    """The one group holding rank; raises if it is in none or several (an invalid partition)."""
    found = [g for g in groups if rank in g]
    if len(found) != 1:
        raise ValueError(f"rank {rank} is in {len(found)} groups of {groups!r}; expected exactly one")
    return found[0]


def validate_partition(groups: RankLists, world_size: int) -> None:
    """Every rank in 0..world_size-1 appears exactly once and all groups have one size."""
    flat = sorted(r for g in groups for r in g)
    if flat != list(range(world_size)):
        raise ValueError(f"groups do not partition range({world_size}): {groups!r}")
    sizes = {len(g) for g in groups}
    if len(sizes) != 1:
        raise ValueError(f"groups have mixed sizes {sorted(sizes)}: {groups!r}")
