"""Weight loaders: pure functions ``loader(sources, rank) -> tensor``.

``sources`` is one lazily sliceable tensor (a safetensors ``PySafeSlice`` or a ``torch.Tensor``) or a mapping
of role → such tensor (e.g. {"q", "k", "v"}). Loaders index only the rows/columns the rank needs, so on a
``PySafeSlice`` only those bytes are read. Because loaders are pure, one process can build every rank's shard
(golden tests), and a component layer substitutes its own group rank with ``with_rank_override``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from modules.parallel.heads import shard_heads

Sources = Any  # SliceLike | Mapping[str, SliceLike]
WeightLoader = Callable[[Sources, int], torch.Tensor]


def slice_shape(src: Any) -> tuple[int, ...]:
    """Shape of a torch.Tensor or a safetensors PySafeSlice."""
    if isinstance(src, torch.Tensor):
        return tuple(src.shape)
    return tuple(src.get_shape())


def _read(src: Any, index: tuple[slice, ...]) -> torch.Tensor:
    if not index:  # 0-d
        return src[...] if isinstance(src, torch.Tensor) else src[:]
    return src[index]


def _single(sources: Sources, what: str) -> Any:
    if isinstance(sources, Mapping):
        if len(sources) != 1:
            raise ValueError(f"{what} expects one source tensor, got roles {sorted(sources)}")
        return next(iter(sources.values()))
    return sources


def _full_index(ndim: int) -> list[slice]:
    return [slice(None)] * ndim


@dataclass(frozen=True)
class ShardSpec:
    """Shard ``dim`` into ``num_shards`` pieces of ``size``; rank r takes piece ``r % num_shards``.

    pad=True zero-pads a short last piece (e.g. vocab not divisible by the shard count) instead of raising.
    """

    dim: int
    size: int
    num_shards: int
    pad: bool = False

    def __post_init__(self) -> None:
        for name in ("size", "num_shards"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"ShardSpec.{name} must be a positive integer, got {v!r}")

    def bounds(self, rank: int, full: int) -> tuple[int, int]:
        """(start, length) of the rows actually present in the source for this rank."""
        if rank < 0:
            raise ValueError(f"rank must be non-negative, got {rank}")
        start = (rank % self.num_shards) * self.size
        if not self.pad and full != self.size * self.num_shards:
            raise ValueError(f"dim {self.dim} has {full} rows but size {self.size} × num_shards {self.num_shards} = "
                             f"{self.size * self.num_shards}; pass pad=True to zero-pad the last shard")
        if self.pad and full > self.size * self.num_shards:
            raise ValueError(f"dim {self.dim} has {full} rows, more than size {self.size} × num_shards "
                             f"{self.num_shards}")
        return start, max(0, min(self.size, full - start))

    def read(self, src: Any, rank: int) -> torch.Tensor:
        shape = slice_shape(src)
        dim = self.dim % len(shape)
        start, length = self.bounds(rank, shape[dim])
        index = _full_index(len(shape))
        index[dim] = slice(start, start + length)
        out = _read(src, tuple(index))
        if length < self.size:
            pad_shape = list(out.shape)
            pad_shape[dim] = self.size - length
            out = torch.cat([out, out.new_zeros(pad_shape)], dim=dim)
        return out.contiguous()


def sharding_weight_loader(shard_dim: int, shard_size: int, num_shards: int, pad: bool = False,
                           transposed: bool = False) -> WeightLoader:
    """Loader taking shard ``rank % num_shards`` of ``shard_dim`` (column-parallel: the output dim; row-parallel:
    the input dim). transposed=True reads a 2-D checkpoint stored as the transpose of the parameter."""
    spec = ShardSpec(shard_dim, shard_size, num_shards, pad)

    def load(sources: Sources, rank: int) -> torch.Tensor:
        src = _single(sources, "sharding_weight_loader")
        if not transposed:
            return spec.read(src, rank)
        if len(slice_shape(src)) != 2:
            raise ValueError(f"transposed=True needs a 2-D tensor, got shape {slice_shape(src)}")
        return ShardSpec(1 - shard_dim % 2, shard_size, num_shards, pad).read(src, rank).t().contiguous()

    load.shard_spec = spec
    return load


def replicated_weight_loader(pad_to: int | None = None, dim: int = -1) -> WeightLoader:
    """Full tensor on every rank (norm weights, routers, row-parallel biases); optional zero-pad of dim."""

    def load(sources: Sources, rank: int) -> torch.Tensor:
        src = _single(sources, "replicated_weight_loader")
        out = _read(src, tuple(_full_index(len(slice_shape(src))))).contiguous()
        if pad_to is not None:
            d = dim % out.dim()
            if out.shape[d] > pad_to:
                raise ValueError(f"cannot pad dim {d} of size {out.shape[d]} down to pad_to={pad_to}")
            if out.shape[d] < pad_to:
                pad_shape = list(out.shape)
                pad_shape[d] = pad_to - out.shape[d]
                out = torch.cat([out, out.new_zeros(pad_shape)], dim=d)
        return out

    return load


def with_rank_override(loader: WeightLoader, rank: int) -> WeightLoader:
    """Ignore the rank the model loader passes (the TP rank) and use ``rank`` (e.g. the component-TP group's
    rank_in_group)."""

    @functools.wraps(loader)
    def load(sources: Sources, _rank: int) -> torch.Tensor:
        return loader(sources, rank)

    load.rank_override = rank
    return load


def fused_qkv_weight_loader(num_heads: int, num_kv_heads: int, head_dim: int, tp_size: int,
                            dim: int = 0) -> WeightLoader:
    """Loader for a fused [q | k | v] projection sharded by heads along ``dim`` (0 for a [out, in] weight or a
    bias). Sources: roles "q", "k", "v" (separate checkpoint tensors) or one "qkv" fused tensor laid out
    [all q heads | all k heads | all v heads]. When tp_size > num_kv_heads each KV head is replicated on
    tp_size / num_kv_heads consecutive ranks."""
    hs = shard_heads(num_heads, num_kv_heads, head_dim, tp_size)
    q_total, kv_total = num_heads * head_dim, num_kv_heads * head_dim

    def piece(src: Any, offset: int, total: int, head_start: int, n_heads: int) -> torch.Tensor:
        shape = slice_shape(src)
        d = dim % len(shape)
        index = _full_index(len(shape))
        start = offset + head_start * head_dim
        index[d] = slice(start, start + n_heads * head_dim)
        if n_heads * head_dim + head_start * head_dim > total:
            raise ValueError(f"head range exceeds {total} rows")
        return _read(src, tuple(index))

    def load(sources: Sources, rank: int) -> torch.Tensor:
        if not isinstance(sources, Mapping):
            sources = {"qkv": sources}
        if not 0 <= rank < tp_size:
            raise ValueError(f"rank={rank} out of range for tp_size={tp_size}")
        if set(sources) == {"qkv"}:
            src = sources["qkv"]
            expect = q_total + 2 * kv_total
            if slice_shape(src)[dim] != expect:
                raise ValueError(f"fused qkv dim {dim} has {slice_shape(src)[dim]} rows, expected {expect} "
                                 f"= ({num_heads} + 2 × {num_kv_heads}) × {head_dim}")
            srcs = {"q": (src, 0), "k": (src, q_total), "v": (src, q_total + kv_total)}
        elif set(sources) == {"q", "k", "v"}:
            for role, total in (("q", q_total), ("k", kv_total), ("v", kv_total)):
                got = slice_shape(sources[role])[dim]
                if got != total:
                    raise ValueError(f"{role} dim {dim} has {got} rows, expected {total}")
            srcs = {r: (sources[r], 0) for r in ("q", "k", "v")}
        else:
            raise ValueError(f"fused_qkv_weight_loader needs roles q,k,v or qkv, got {sorted(sources)}")
        q = piece(*srcs["q"], q_total, hs.q_head_start(rank), hs.q_heads_per_rank)
        k = piece(*srcs["k"], kv_total, hs.kv_head_start(rank), hs.kv_heads_per_rank)
        v = piece(*srcs["v"], kv_total, hs.kv_head_start(rank), hs.kv_heads_per_rank)
        return torch.cat([q, k, v], dim=dim).contiguous()

    load.head_sharding = hs
    return load


def set_weight_loader(param: torch.nn.Parameter, loader: WeightLoader) -> None:
    param.weight_loader = loader


def get_weight_loader(param: torch.nn.Parameter) -> WeightLoader:
    """The parameter's loader, or a replicated loader for parameters that declare none."""
    return getattr(param, "weight_loader", None) or replicated_weight_loader()


def load_from_tensors(model: torch.nn.Module, tensors: Mapping[str, torch.Tensor], rank: int,
                      mappings: Mapping[str, str | Mapping[str, str]] | None = None) -> None:
    """In-memory counterpart of SafetensorsCheckpoint.load_sharded: shard full tensors into model as rank."""
    mappings = mappings or {}
    for name, param in model.named_parameters():
        target = mappings.get(name, name)
        try:
            sources = tensors[target] if isinstance(target, str) else {r: tensors[k] for r, k in target.items()}
        except KeyError as e:
            raise KeyError(f"no tensor {e.args[0]!r} (needed by parameter {name!r})") from None
        out = get_weight_loader(param)(sources, rank)
        if tuple(out.shape) != tuple(param.shape):
            raise ValueError(f"parameter {name!r}: loaded shape {tuple(out.shape)} != parameter shape "
                             f"{tuple(param.shape)}")
        with torch.no_grad():
            param.copy_(out)


def transposed_weight_loader(loader: WeightLoader) -> WeightLoader:
    """The 2-D result of ``loader`` transposed: a checkpoint's [out, in] shard placed into a kernel's [in, out]
    parameter (e.g. the decode kernel's W_qkv [H, cols] and W_o [q heads * d, H])."""

    @functools.wraps(loader)
    def load(sources: Sources, rank: int) -> torch.Tensor:
        out = loader(sources, rank)
        if out.dim() != 2:
            raise ValueError(f"transposed_weight_loader needs a 2-D shard, got shape {tuple(out.shape)}")
        return out.t().contiguous()

    return load


def reshaped_weight_loader(loader: WeightLoader, shape: tuple[int, ...]) -> WeightLoader:
    """The result of ``loader`` viewed as ``shape`` (e.g. a [H] norm weight placed into a kernel's [1, H])."""

    @functools.wraps(loader)
    def load(sources: Sources, rank: int) -> torch.Tensor:
        return loader(sources, rank).reshape(shape).contiguous()

    return load


def gate_up_weight_loader(intermediate_size: int, num_shards: int, dim: int = 0) -> WeightLoader:
    """Loader for a fused [gate | up] column-parallel projection sharded over the intermediate dim.

    Rank r gets ``cat(gate[r-th I/n rows], up[r-th I/n rows])`` along ``dim`` (0 for an [out, in] weight or a
    bias), so its local SwiGLU is ``silu(y[:I/n]) * y[I/n:]``. Sources: roles "gate" and "up" (HF Llama's
    separate gate_proj / up_proj) or one "gate_up" tensor laid out [all gate rows | all up rows].
    Only the rank's rows are read.
    """
    if intermediate_size % num_shards:
        raise ValueError(f"gate_up_weight_loader: intermediate_size={intermediate_size} is not divisible by "
                         f"num_shards={num_shards}")
    per = intermediate_size // num_shards

    def rows(src: Any, offset: int, rank: int) -> torch.Tensor:
        shape = slice_shape(src)
        d = dim % len(shape)
        index = _full_index(len(shape))
        start = offset + (rank % num_shards) * per
        index[d] = slice(start, start + per)
        return _read(src, tuple(index))

    def load(sources: Sources, rank: int) -> torch.Tensor:
        if not isinstance(sources, Mapping):
            sources = {"gate_up": sources}
        if set(sources) == {"gate_up"}:
            src = sources["gate_up"]
            got = slice_shape(src)[dim]
            if got != 2 * intermediate_size:
                raise ValueError(f"fused gate_up dim {dim} has {got} rows, expected 2 × {intermediate_size}")
            gate, up = rows(src, 0, rank), rows(src, intermediate_size, rank)
        elif set(sources) == {"gate", "up"}:
            for role in ("gate", "up"):
                got = slice_shape(sources[role])[dim]
                if got != intermediate_size:
                    raise ValueError(f"{role} dim {dim} has {got} rows, expected intermediate_size="
                                     f"{intermediate_size}")
            gate, up = rows(sources["gate"], 0, rank), rows(sources["up"], 0, rank)
        else:
            raise ValueError(f"gate_up_weight_loader needs roles gate,up or gate_up, got {sorted(sources)}")
        return torch.cat([gate, up], dim=dim).contiguous()

    return load


def head_range_weight_loader(head_start: int, num_heads: int, head_dim: int, total_heads: int,
                             dim: int = 0) -> WeightLoader:
    """Rows [head_start * head_dim, (head_start + num_heads) * head_dim) of ``dim`` of a per-head tensor
    (total_heads * head_dim rows): a fixed head range, e.g. the K/V heads of one TP position that every
    attention-DP rank of its column holds."""
    if head_start < 0 or num_heads < 1 or head_start + num_heads > total_heads:
        raise ValueError(f"head range [{head_start}, {head_start + num_heads}) is outside 0..{total_heads}")

    def load(sources: Sources, rank: int) -> torch.Tensor:
        src = _single(sources, "head_range_weight_loader")
        shape = slice_shape(src)
        d = dim % len(shape)
        if shape[d] != total_heads * head_dim:
            raise ValueError(f"dim {d} has {shape[d]} rows, expected {total_heads} heads × {head_dim}")
        index = _full_index(len(shape))
        index[d] = slice(head_start * head_dim, (head_start + num_heads) * head_dim)
        return _read(src, tuple(index)).contiguous()

    return load
