"""Host-side token → block → expert mapping for the blockwise CTE (prefill) MoE kernel.

Each (token, slot) pair of the routing (expert_index [T, k]) is one row of work for its expert. An expert's rows are
packed, in token order, into blocks of `block_size` rows; its last block is padded with -1. Blocks are ordered by
expert id, so the kernel loads each expert's weights once and serves all its blocks with them. The array sizes use
the dropless worst case of the issue (and of NxD's `get_blockwise_expert_and_token_mapping`):

    N = min(ceil((T·k − (E−1)) / B) + (E−1), T·k)

(every expert's last block can be partly empty, at most E−1 of them besides the ones the rows fill), so the arrays
have static shapes; blocks past `num_blocks` are padding (block_to_expert −1, all rows −1).

Besides the fields of the issue the record carries what the kernel schedule needs, all derived here once:
`token_position_to_slot` (the flat index t·k + j of each row, −1 padding: the row's affinity is affinities.flat[slot]),
and per active expert (experts in increasing id, those with no rows left out) its id, first block and block count.
"""

from dataclasses import dataclass

import numpy as np

BLOCK_MIN, BLOCK_MAX, BLOCK_ALIGN = 128, 512, 128     # block sizes the kernel supports (rows are 128-row tiles)


@dataclass(frozen=True)
class BlockwiseMapping:
    """Token → block → expert mapping (NumPy int32 arrays; see the module docstring)."""

    block_size: int
    tokens_per_expert: np.ndarray        # [E] rows routed to each expert
    block_to_expert: np.ndarray          # [N] expert of each block, −1 for padding blocks
    token_position_to_id: np.ndarray     # [N·B] token id of each row, −1 padding
    token_position_to_slot: np.ndarray   # [N·B] flat routing index t·k + j of each row, −1 padding
    num_blocks: int                      # real blocks (the first num_blocks entries of block_to_expert)
    active_experts: np.ndarray           # [E] experts with rows, increasing, then −1
    expert_first_block: np.ndarray       # [E] first block of each active expert (aligned with active_experts), then 0
    expert_num_blocks: np.ndarray        # [E] blocks of each active expert, then 0
    num_active: int                      # experts with at least one row

    @property
    def max_blocks(self) -> int:
        return int(self.block_to_expert.shape[0])


def max_blocks(num_rows: int, num_experts: int, block_size: int) -> int:
    """Static block count N for T·k = num_rows routed rows (the dropless worst case, capped at one row per block)."""
    bound = -(-(num_rows - (num_experts - 1)) // block_size) + (num_experts - 1)
    return max(1, min(bound, num_rows))


def check_block_size(block_size, op="blockwise_mapping"):
    if (not isinstance(block_size, (int, np.integer)) or isinstance(block_size, bool)
            or not BLOCK_MIN <= block_size <= BLOCK_MAX or block_size % BLOCK_ALIGN):
        raise ValueError(f"{op}: block_size={block_size!r} must be a multiple of {BLOCK_ALIGN} in "
                         f"[{BLOCK_MIN}, {BLOCK_MAX}]")


def _as_numpy(t):
    return np.asarray(t.cpu() if hasattr(t, "cpu") else t)


def blockwise_mapping(expert_index, num_experts, block_size) -> BlockwiseMapping:
    """Token → block → expert mapping of the routing expert_index [T, k] (local expert ids in [0, num_experts))."""
    check_block_size(block_size)
    idx = _as_numpy(expert_index)
    if idx.ndim != 2 or idx.shape[0] < 1 or idx.shape[1] < 1:
        raise ValueError(f"blockwise_mapping: expert_index must be [T, k] with T, k >= 1, got shape {idx.shape}")
    if not np.issubdtype(idx.dtype, np.integer):
        raise ValueError(f"blockwise_mapping: expert_index must be an integer tensor, got {idx.dtype}")
    E = int(num_experts)
    T, k = idx.shape
    if k > E:
        raise ValueError(f"blockwise_mapping: top_k={k} exceeds num_experts={E}")
    if idx.min() < 0 or idx.max() >= E:
        raise ValueError(f"blockwise_mapping: expert ids must be in [0, num_experts={E}); got "
                         f"[{idx.min()}, {idx.max()}]")
    flat = idx.reshape(-1).astype(np.int64)
    # rows of each expert in token order: a stable sort by expert keeps the flat (token-major) order inside an expert
    order = np.argsort(flat, kind="stable")
    counts = np.bincount(flat, minlength=E)
    blocks = -(-counts // block_size)
    N = max_blocks(T * k, E, block_size)
    n_real = int(blocks.sum())
    assert n_real <= N, (n_real, N)   # the bound holds for every routing (each expert wastes < B rows)

    first_block = np.concatenate([[0], np.cumsum(blocks)[:-1]])
    block_to_expert = np.full(N, -1, np.int32)
    block_to_expert[:n_real] = np.repeat(np.arange(E), blocks)
    # row position of each routed row: its expert's first row + its rank among that expert's rows
    start_row = np.concatenate([[0], np.cumsum(counts)[:-1]])
    rank = np.arange(flat.size) - start_row[flat[order]]
    pos = first_block[flat[order]] * block_size + rank
    slot = np.full(N * block_size, -1, np.int32)
    slot[pos] = order
    token = np.where(slot >= 0, slot // k, -1).astype(np.int32)

    active = np.nonzero(counts)[0]
    pad = E - active.size
    return BlockwiseMapping(
        block_size=int(block_size), tokens_per_expert=counts.astype(np.int32), block_to_expert=block_to_expert,
        token_position_to_id=token, token_position_to_slot=slot, num_blocks=n_real,
        active_experts=np.concatenate([active, np.full(pad, -1)]).astype(np.int32),
        expert_first_block=np.concatenate([first_block[active], np.zeros(pad)]).astype(np.int32),
        expert_num_blocks=np.concatenate([blocks[active], np.zeros(pad)]).astype(np.int32),
        num_active=int(active.size))
