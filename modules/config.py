"""Parallelism configs for the text model (NeuronConfig) and the vision encoder (VisionNeuronConfig).

Validation follows the seeds: ``tensor-parallelism``, ``component-level-dp-sharding`` and
``vision-encoder-parallelism``. Every error names the offending field and its value.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

COMPONENT_DP_FIELDS = ("attention_dp_size", "embedding_dp_size", "mlp_dp_size", "lm_head_dp_size")


def _check_positive_int(name: str, value: object) -> int:
    # bool is an int subclass; True as a degree is always a bug.
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def _check_buckets(name: str, buckets: tuple[int, ...], multiple_of: int = 1, above: int = 0) -> tuple[int, ...]:
    buckets = tuple(buckets)
    for b in buckets:
        _check_positive_int(f"{name} entry", b)
        if b % multiple_of:
            raise ValueError(f"{name} entry {b} must be divisible by tp_size={multiple_of} (sequence parallel)")
        if b <= above:
            raise ValueError(f"{name} entry {b} must be > tp_size={above}: sequence parallel splits the padded "
                             f"prefill tokens T over the TP group and needs T > tp_size and T % tp_size == 0")
    if list(buckets) != sorted(set(buckets)):
        raise ValueError(f"{name} must be strictly increasing, got {buckets!r}")
    return buckets


def select_bucket(n: int, buckets: tuple[int, ...], name: str = "buckets") -> int:
    """Smallest bucket >= n (the scheduler pads the token count up to it)."""
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"no bucket in {name}={tuple(buckets)!r} fits n={n}")


@dataclass
class NeuronConfig:
    """Text-model parallel layout: tp_size × dp_size ranks, component DP sizes, EP and buckets.

    Each ``*_dp_size`` shards that component's weights over ``tp_size * component_dp`` ranks (decode only).
    """

    tp_size: int = 1
    dp_size: int = 1
    attention_dp_size: int = 1
    embedding_dp_size: int = 1
    mlp_dp_size: int = 1
    lm_head_dp_size: int = 1
    ep_degree: int = 1
    prefill_buckets: tuple[int, ...] = ()
    decode_buckets: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        _check_positive_int("tp_size", self.tp_size)
        _check_positive_int("dp_size", self.dp_size)
        _check_positive_int("ep_degree", self.ep_degree)
        for name in COMPONENT_DP_FIELDS:
            value = _check_positive_int(name, getattr(self, name))
            if self.dp_size % value:
                raise ValueError(f"{name}={value} must divide dp_size={self.dp_size}")
        if self.mlp_dp_size > 1 and self.ep_degree > 1:
            # MoE models shard experts with EP; sharding the MLP intermediate over DP as well is unsupported.
            raise ValueError(
                f"mlp_dp_size={self.mlp_dp_size} > 1 is incompatible with ep_degree={self.ep_degree} > 1"
            )
        # SP splits the prefill token dim over the TP group: every prefill bucket T > tp_size, T % tp_size == 0
        # (the TP seed's rule; the prefill model checks it again for an explicit bucket).
        self.prefill_buckets = _check_buckets("prefill_buckets", self.prefill_buckets, self.tp_size, self.tp_size)
        self.decode_buckets = _check_buckets("decode_buckets", self.decode_buckets)

    @property
    def world_size(self) -> int:
        return self.tp_size * self.dp_size

    def component_dp_sizes(self) -> dict[str, int]:
        return {name.removesuffix("_dp_size"): getattr(self, name) for name in COMPONENT_DP_FIELDS}

    def validate_world_size(self, world_size: int) -> None:
        """Raise unless tp_size * dp_size == world_size (every rank must belong to exactly one TP×DP cell)."""
        if self.tp_size * self.dp_size != world_size:
            raise ValueError(
                f"tp_size * dp_size = {self.tp_size} * {self.dp_size} = {self.tp_size * self.dp_size} "
                f"!= world_size={world_size}"
            )

    def select_prefill_bucket(self, n: int) -> int:
        return select_bucket(n, self.prefill_buckets, "prefill_buckets")

    def select_decode_bucket(self, n: int) -> int:
        return select_bucket(n, self.decode_buckets, "decode_buckets")


@dataclass
class VisionNeuronConfig:
    """Vision-encoder layout: tp_size shards weights, dp_size scatters the packed num_blocks dim.

    ``None`` means "not set by the user"; ``resolve_tp_dp`` fills both in and writes them back.
    """

    tp_size: int | None = None
    dp_size: int | None = None
    # Compiled encoder shapes: one (block_size, num_total_vision_attention_blocks) pair per bucket.
    buckets: tuple[tuple[int, int], ...] = ()
    _resolved_world: int | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.tp_size is not None:
            _check_positive_int("tp_size", self.tp_size)
        if self.dp_size is not None:
            _check_positive_int("dp_size", self.dp_size)
        self.buckets = _check_vision_buckets(self.buckets)
        # Block padding point 1 (seed): the compiled num_blocks of every bucket is a multiple of dp. When dp is
        # still to be inferred from the world size, resolve_tp_dp pads them instead.
        if self.dp_size is not None:
            self.buckets = _pad_vision_buckets(self.buckets, self.dp_size)

    def resolve_tp_dp(self, world_size: int) -> tuple[int, int]:
        """Resolve (tp_size, dp_size) for world_size, per the vision seed's rules, and write them back.

        Only tp set → dp = world // tp; neither set → tp 1, dp = world (full DP); both set → tp*dp must equal
        world. Calling it again with the same world size is idempotent (worker init and runner init both call it).
        """
        _check_positive_int("world_size", world_size)
        tp = 1 if self.tp_size is None else self.tp_size
        if world_size % tp:
            raise ValueError(f"tp_size={tp} must divide world_size={world_size}")
        if self.dp_size is None:
            dp = world_size // tp
        else:
            dp = self.dp_size
            if tp * dp != world_size:
                # All ranks must participate: no redundant compute, no idle ranks.
                raise ValueError(
                    f"tp_size * dp_size = {tp} * {dp} = {tp * dp} != world_size={world_size}"
                    + ("" if self.tp_size is not None else "; set tp_size explicitly")
                )
        self.tp_size, self.dp_size, self._resolved_world = tp, dp, world_size
        self.buckets = _pad_vision_buckets(self.buckets, dp)
        return tp, dp

    def _require_resolved(self) -> int:
        if self.dp_size is None:
            raise ValueError("VisionNeuronConfig.dp_size is unresolved; call resolve_tp_dp(world_size) first")
        return self.dp_size

    def padded_num_blocks(self, num_blocks: int) -> int:
        """num_blocks rounded up to a multiple of dp_size (even block scatter)."""
        return pad_num_blocks(num_blocks, self._require_resolved())

    def pad_blocks(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        return pad_blocks(x, self._require_resolved(), dim=dim)


# A vision block is the kernel's sequence tile: whole 128-row partition tiles (the vision seed's block sizes).
VISION_BLOCK_ALIGN = 128


def check_vision_block_size(block_size: int, merge_unit: int = 1) -> int:
    """block_size must be a positive multiple of 128 and of the merger's unit (spatial_merge_size**2 patches), so a
    merge group never straddles two blocks."""
    _check_positive_int("block_size", block_size)
    if block_size % VISION_BLOCK_ALIGN:
        raise ValueError(f"block_size={block_size} must be a multiple of {VISION_BLOCK_ALIGN}")
    if block_size % merge_unit:
        raise ValueError(f"block_size={block_size} must be a multiple of the merge unit {merge_unit} "
                         "(spatial_merge_size**2 patches)")
    return block_size


def _check_vision_buckets(buckets) -> tuple[tuple[int, int], ...]:
    out = []
    for b in tuple(buckets):
        if not (isinstance(b, tuple | list) and len(b) == 2):
            raise ValueError(f"buckets entry {b!r} must be a (block_size, num_blocks) pair")
        check_vision_block_size(b[0])
        _check_positive_int("buckets num_blocks", b[1])
        out.append((b[0], b[1]))
    if len(set(out)) != len(out):
        raise ValueError(f"buckets has duplicate entries: {tuple(out)!r}")
    return tuple(sorted(out))


def _pad_vision_buckets(buckets: tuple[tuple[int, int], ...], dp_size: int) -> tuple[tuple[int, int], ...]:
    # Padding can make two buckets equal (e.g. 3 and 4 blocks at dp 4): keep one.
    return tuple(sorted({(bs, pad_num_blocks(n, dp_size)) for bs, n in buckets}))


def pad_num_blocks(num_blocks: int, dp_size: int) -> int:
    """Round num_blocks up to a multiple of dp_size. Zero stays zero."""
    if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 0:
        raise ValueError(f"num_blocks must be a non-negative integer, got {num_blocks!r}")
    _check_positive_int("dp_size", dp_size)
    return math.ceil(num_blocks / dp_size) * dp_size


def pad_blocks(x: torch.Tensor, dp_size: int, dim: int = 0) -> torch.Tensor:
    """Zero-pad x along dim to a multiple of dp_size. Padding blocks produce zero outputs downstream."""
    n = x.shape[dim]
    target = pad_num_blocks(n, dp_size)
    if target == n:
        return x
    pad_shape = list(x.shape)
    pad_shape[dim] = target - n
    return torch.cat([x, x.new_zeros(pad_shape)], dim=dim)
